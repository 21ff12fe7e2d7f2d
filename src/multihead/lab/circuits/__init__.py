"""Circuits on causal language models, on the fast kernel: which heads carry an answer, and what they are.

    exact = multihead.lab.circuits.activation_patching(model, clean_ids, corrupt_ids, answer=12, wrong=40)
    cheap = multihead.lab.circuits.attribution_patching(model, clean_ids, corrupt_ids, answer=12, wrong=40)
    found = multihead.lab.circuits.detect_heads(model, multihead.lab.circuits.repeated_random_tokens(50257, 20))
    shares = multihead.lab.circuits.direct_logit_attribution(model, clean_ids, answer=12, wrong=40).heads
    lens = multihead.lab.circuits.logit_lens(model, clean_ids, answer=12, wrong=40)

``model`` is any causal LM whose attention runs on our kernel: a :class:`~multihead.lab.models.Decoder`, or a
transformers ``*ForCausalLM`` loaded with ``attn_implementation="multihead"``. Every tool reaches the heads
through their :class:`~multihead.attend.Attend` steps' hooks, so only the heads a tool reads or patches do more
than the model's own kernel call. Modules: patching (activation and attribution patching), paths (path
patching), detectors (previous-token, duplicate-token and induction scores, sinks), lens (direct logit
attribution, the logit lens), weights (QK and OV circuits, composition scores), rollout (attention rollout).
"""

from multihead.lab.circuits.detectors import (
    DETECTORS,
    SINK_THRESHOLD,
    HeadDetection,
    detect_heads,
    detection_patterns,
    detector_behaviours,
    probe_heads,
    repeated_random_tokens,
)
from multihead.lab.circuits.lens import (
    LensParts,
    LogitAttribution,
    LogitLens,
    direct_logit_attribution,
    lens_parts,
    logit_lens,
)
from multihead.lab.circuits.patching import (
    Agreement,
    PatchingResult,
    activation_patching,
    agreement,
    attribution_patching,
)
from multihead.lab.circuits.paths import path_patching
from multihead.lab.circuits.rollout import attention_rollout
from multihead.lab.circuits.weights import (
    COMPOSITIONS,
    HeadCircuit,
    HeadWeights,
    composition_scores,
    head_circuit,
    head_weights,
)

__all__ = [
    "activation_patching",
    "attribution_patching",
    "path_patching",
    "agreement",
    "Agreement",
    "PatchingResult",
    "detect_heads",
    "detector_behaviours",
    "probe_heads",
    "detector_behaviours",
    "detection_patterns",
    "repeated_random_tokens",
    "HeadDetection",
    "DETECTORS",
    "SINK_THRESHOLD",
    "direct_logit_attribution",
    "LogitAttribution",
    "logit_lens",
    "LogitLens",
    "lens_parts",
    "LensParts",
    "head_weights",
    "HeadWeights",
    "head_circuit",
    "HeadCircuit",
    "composition_scores",
    "COMPOSITIONS",
    "attention_rollout",
]
