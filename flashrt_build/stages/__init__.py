"""The build's stages, in the order a build runs them; `flashrt_build.pipeline`
strings them together. Each stage function returns a `progress.Stage`: its
value, its manifest sections and its log note.

    preflight.py      1. the config's checks that need torch: options, device, method names, targets
    module.py         2. instantiate the module (checkpoint.py: load its weights strictly), cast it
    quantize.py          quantize its Linear weights by the `quant` recipe (torchao)
    domain.py         3. the config's inputs against the eager module, before the compile
    inputs.py            seeded example inputs and torch.export dynamic shapes
    export.py         4. torch.export: one graph per method or an error naming the cause
    compile.py        5. AOTInductor compiles each graph into a .pt2 package
    package.py        5. what the package binds and takes; sealed with what a load relies on
    weights.py           the tensors a package binds: names, layouts, digests, the sidecar
    verify.py         6. the package against eager, in a fresh process (compare.py: leaf by leaf)
    verify_worker.py     that process: loads the package as `load` does
    timing.py            optional timing there against eager and torch.compile
    assemble.py       7. the manifest, from the stages' sections
    publish.py        7. lock, staging directory, one atomic move into place
    progress.py       a stage's result, one log line (and a live timer) per stage
    threads.py        CPU threads a build may use

The config itself is `flashrt_build.config`. May import `config`, `runtime`,
`artifact` and `errors`; never `cache`, `sweep` or the pipeline.
"""
