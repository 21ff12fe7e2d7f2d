"""The project's benchmark harness (not installed with multihead): run by ``benchmarks/*.py``.

    kernel   multihead.attention (auto, tiled) vs the textbook code vs torch SDPA, time and peak memory
    layer    multihead.MultiHeadAttention vs a textbook module vs torch.nn.MultiheadAttention, and decode
             with and without the KV cache
    suite    both, then every case scored against this machine's roofline (bench.json / .md / .png);
             ``--rescore`` scores results already written
    common   what kernel and layer share: the allocator setting (``ensure_malloc_env``), measurement,
             machine info, targets, reports and the command line

Each benchmark module has ``Config`` (``Config.quick_config(**overrides)`` for --quick), ``run(config,
progress=None) -> dict``, ``write_reports(results, out_dir, stem) -> str`` (JSON, markdown and PNG;
returns the markdown), ``write_json``, ``plot`` and ``main(argv)``. Memory numbers need glibc's
MALLOC_MMAP_THRESHOLD_ set before the process starts: ``main`` (and ``common.ensure_malloc_env()``)
re-executes the process with it.

What users run is ``multihead bench`` (multihead.lab.bench): a short interleaved comparison with the same
peers, built on torch.utils.benchmark. The textbook peers are multihead.lab.bench's, so both time the same code.
"""
