"""The build's stages, in the order a build runs them (`flashrt_build.pipeline`
strings them together):

    module.py         2. instantiate the module, load its checkpoint, cast it
    inputs.py         3. seeded example inputs and torch.export dynamic shapes
    domain.py         3. the config's inputs against the eager module, before the compile
    export.py         4. torch.export: one graph or an error naming the cause
    package.py        5. AOTInductor compiles the graph into a .pt2 package
    weights.py        5. the tensors the package binds: names, digests, sidecar
    verify.py         6. the package against eager, in a fresh process
    verify_worker.py     that process: loads the package as `load` does
    timing.py            optional timing there against eager and torch.compile
    publish.py        7. lock, staging directory, one atomic move into place
    toolchain.py      what produced the package, for the manifest
    progress.py       one log line (and a live timer) per stage
    threads.py        CPU threads a build may use

Stage 1, the config, is `flashrt_build.config`. May import `config`,
`runtime` and `errors`; never `cache`, `sweep` or the pipeline.
"""
