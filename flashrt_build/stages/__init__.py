"""The build's stages; `flashrt_build.pipeline` runs them in its order
(`STAGES` there). Each stage function returns a `progress.Stage`: its value,
its manifest sections and its log note.

    preflight.py        the config's checks that need torch: options, device, method names, targets
    module.py           instantiate the module, cast it (checkpoint.py: load its weights strictly)
    checkpoint.py       a checkpoint streamed into the module, names renamed, tied weights given once
    objects.py          a build from a module object: the copy it builds, keyed by what the object is
    reference.py        the module as given, run over the verification's calls before any pass rewrites it
    passes.py           graph passes on the module before export: projections fused, and the others
    fused.py            the fused projections' layers: one Linear for the group, a slice for each member
    quantize.py         quantize its Linear weights by the `quant` recipe (torchao), a fused one by its members' rule
    attention.py        the grouped_attention pass: grouped-query attention without copying the cache
    gemv.py             the gemv pass: a CUDA package's one-row matmuls as a Triton GEMV compiled in
    decode_attention.py the decode_attention pass: a one-token step's attention as a Triton split-KV kernel
    triton_kernels.py   those passes' Triton kernels, imported on first use (it needs Triton)
    domain.py           the config's inputs against the eager module, before the compile
    inputs.py           seeded example inputs and torch.export dynamic shapes
    export.py           torch.export: one graph per method or an error naming the cause
    experts.py          mixture-of-experts layers switched to experts a package can run, at export
    exporting.py        whether a trace is running (is_exporting): model code and the decode passes ask it
    rewrites.py         the passes that rewrite the exported graph, in one table (switch, rewrite, log words)
    gemv_fusion.py      the gemv_fusion pass: the norm, SiLU gate and residual add around a GEMV in its kernel
    rotary_fusion.py    the rotary_fusion pass: the query's rotary embedding in the decode attention kernel
    graph_match.py      what those rewrites share to read an exported graph
    pdl.py              the pdl pass: the package's own kernels launched as programmatic dependents
    custom_ops.py       custom operators in the graph: decomposed, their library recorded, Triton's kept, or refused
    int8_matmul.py      int8 matmuls a CUDA graph calls, padded past cuBLAS's 16-row floor
    compile.py          AOTInductor compiles each graph (or links a model kept by its key)
    archive.py          the .pt2 archive: constant names read, models combined, the contract sealed
    package.py          what the package binds and takes; its state and served files
    weights.py          the tensors a package binds: names, layouts, digests, the sidecar
    verify.py           the package against eager, call by call
    compare.py          leaf by leaf, within the tolerances; the quantization error against float
    verify_process.py   the fresh process the package runs in: started, timed, its crash said
    verify_worker.py    that process: loads the package as `load` does
    timing.py           optional timing there against eager and torch.compile
    assemble.py         the manifest, from the stages' sections: a draft, then the record
    progress.py         a stage's result, one log line (and a live timer) per stage
    threads.py          CPU threads a build may use

The config itself is `flashrt_build.config`; publishing into the output
directory is `flashrt_build.cache.publish`, which the cache shares. May import `config`, `runtime`,
`artifact` and `errors`; never `cache`, `sweep` or the pipeline.
"""
