import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # workers.py, importable by the spawned ranks
