"""Entry point of `uv run apps/train` (and the `klppo-train` script)."""

from importlib.metadata import version

DISTRIBUTIONS = (
    "klppo-ppo-core",
    "klppo-batching",
    "klppo-fsdp-sharding",
    "klppo-rollout",
    "klppo-train",
)


def main() -> int:
    # The PPO loop lands with issue 6; until then the app reports what is installed.
    for dist in DISTRIBUTIONS:
        print(f"{dist} {version(dist)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
