"""The lab: what multihead builds on its core to look into models, installed with ``pip install 'multihead[lab]'``.

    multihead.lab.inspect      capture, statistics, roles, importance and syntax scores, and their reports
    multihead.lab.models       encoders, decoders and encoder-decoders built from the layer; checkpoints, tokenizers
    multihead.lab.circuits     patching, direct logit attribution, the logit lens, head detectors, QK/OV circuits
    multihead.lab.train        small models trained from scratch on synthetic tasks, and their scores
    multihead.lab.bench        the benchmark suite and calibration (bench_report prints them)

Nothing in the core (every module of ``multihead`` outside ``lab``, ``cli`` and ``integrations``) imports the lab;
``tests/test_architecture.py`` holds that rule. The subpackages load on first use, as attributes
(``multihead.lab.inspect``) or imports; each checks for the lab extra first (:func:`multihead.lab.extra.require_lab`).
"""

from multihead._modules import submodule_on_first_use

_SUBPACKAGES = ("inspect", "models", "circuits", "train", "bench")


def __getattr__(name: str):
    return submodule_on_first_use(__name__, name)


__all__ = list(_SUBPACKAGES)
