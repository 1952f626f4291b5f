"""Not building what is built: the plan, the build key, the store, and the
output directories they fill.

    plan.py      a build resolved once: spec, input digests, toolchain, key ingredients, keys
    key.py       the hash of everything that determines an artifact's bytes
    digests.py   file digests remembered by stat (git's index), so no-ops stay cheap
    reuse.py     reuse or build: an up-to-date artifact is a no-op; an identical stored one is linked
    store.py     the content-addressed store under the output root (compiled models kept by key)
    publish.py   an output directory's lock, its staging directory, one atomic move into place

Imports no torch. May import `config`, `runtime`, `artifact` and `errors`; never
`stages` (the compile stage asks for kept models through `stages.compile.KeptModels`).
"""
