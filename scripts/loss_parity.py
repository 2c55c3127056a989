"""Loss parity between two training runs; see recipes/parity_cli.py or --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.parity_cli import main  # noqa: E402

if __name__ == "__main__":
    main()
