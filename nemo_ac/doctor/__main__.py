"""``python -m nemo_ac.doctor`` (same as ``nemo-ac doctor``)."""

import sys

from nemo_ac.doctor.runner import main

if __name__ == "__main__":
    sys.exit(main())
