"""The baseline for bench/noop_build.py: a Hydra app that composes a config and exits."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> None:
    pass


if __name__ == "__main__":
    main()
