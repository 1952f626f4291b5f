"""Not building what is built: the build key and the store.

    key.py      the hash of everything that determines an artifact's bytes
    digests.py  file digests remembered by stat (git's index), so no-ops stay cheap
    reuse.py    an up-to-date artifact is a no-op; an identical stored one is linked
    store.py    the content-addressed store under the output root

Imports no torch. May import `config`, `runtime.manifest`, `stages.publish`
(its lock and atomic move) and `errors`.
"""
