"""``python3 -m lowbit ...`` = the ``lowbit`` command (works where pip's script folder is not on PATH)."""
import sys

from lowbit.cli import main

sys.exit(main())
