"""ComfyUI's comfy.cli_args, reduced to the flags poolipc reads (parsed from sys.argv)."""
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--cuda-device", type=int, default=None)
parser.add_argument("--default-device", type=int, default=None)
cm = parser.add_mutually_exclusive_group()
cm.add_argument("--cuda-malloc", action="store_true")
cm.add_argument("--disable-cuda-malloc", action="store_true")
parser.add_argument("--directml", type=int, nargs="?", const=-1)
parser.add_argument("--cpu", action="store_true")
parser.add_argument("--quick-test-for-ci", action="store_true")
args = parser.parse_args()
