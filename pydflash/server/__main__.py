import sys

from .cli import main

if __name__ == "__main__":   # `python -m pydflash.server`; importing the module (tests walk every one) runs nothing
    sys.exit(main())
