"""multihead.bench: the benchmarks, importable (for ``benchmarks/*.py`` and a ``multihead bench`` command).

    kernel   multihead.attention (auto, tiled) vs a textbook implementation vs torch SDPA
    layer    multihead.MultiHeadAttention vs a textbook module vs torch.nn.MultiheadAttention, and decode
             with and without the KV cache
    common   what both share: the allocator setting (``ensure_malloc_env``), measurement, machine info,
             targets, reports and the command line

Each benchmark module has ``Config`` (``Config.quick_config(**overrides)`` for --quick), ``run(config,
progress=None) -> dict``, ``write_reports(results, out_dir, stem) -> str`` (JSON, markdown and PNG;
returns the markdown), ``write_json``, ``plot`` and ``main(argv)``. Memory numbers need glibc's
MALLOC_MMAP_THRESHOLD_ set before the process starts: ``main`` (and ``common.ensure_malloc_env()``)
re-executes the process with it.

Nothing is imported here: ``import multihead`` does not load the benchmarks, and importing one of
them loads only it and ``common``.
"""
