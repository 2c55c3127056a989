"""The parity tool's proof runs on a real config; see recipes/parity_campaign.py or --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.parity_campaign import main  # noqa: E402

if __name__ == "__main__":
    main()
