"""A built artifact and running it: what a deployment needs, and what the
build's verification uses to load a package exactly as users do.

    manifest.py    the artifact's files, the manifest's schema, digests
    checkpoint.py  reading checkpoints and comparing them with a package's tensors
    gpu.py         the GPU a package runs on: its identity, architecture, TF32 policy
    load.py        `load(dir)`: digests checked, weights bound, a drop-in nn.Module

May import `config` and `errors`. `manifest.py` imports no torch (the build
key and the up-to-date check read manifests without it).
"""
