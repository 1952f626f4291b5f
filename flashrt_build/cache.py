"""Up to date means free: a build whose key matches a complete, intact
artifact at its output directory does no work. Imports no torch."""

from __future__ import annotations

from typing import Any

from .errors import ArtifactError
from .key import changed_ingredients
from .manifest import file_sha256, read_manifest
from .spec import BuildSpec


def check_up_to_date(spec: BuildSpec, keys: dict[str, str], ingredients: dict[str, Any]) -> tuple[bool, str]:
    """(True, why) when the artifact in place has this build key, every file it
    lists is intact, and it verified if verification is asked for; else (False, why)."""
    try:
        manifest = read_manifest(spec.output_dir)
    except ArtifactError:
        return False, "no complete build at the output directory"
    if manifest.get("build_key") != keys["build_key"]:
        changed = changed_ingredients(manifest.get("key_ingredients"), ingredients)
        return False, f"changed: {', '.join(changed)}"
    for section in (manifest["package"], manifest["weights"], manifest.get("state") or {}):
        if section.get("file"):
            path = spec.output_dir / section["file"]
            if not path.is_file() or file_sha256(path) != section["sha256"]:
                return False, f"{section['file']} is missing or altered"
    if spec.verify and manifest["verification"].get("passed") is not True:
        return False, "the build in place was not verified"
    return True, f"up to date (build key {keys['build_key'][:12]})"
