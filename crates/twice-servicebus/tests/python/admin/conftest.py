"""Lets the restart phase import the helpers of test_admin.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
