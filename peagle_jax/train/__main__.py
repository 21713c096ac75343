"""`python -m peagle_jax.train --config configs/train/peagle_smollm2.yaml [key=value ...]`.

The training entry point, the same as `python -m peagle_jax.train.train` (see `train.py`).
"""

from peagle_jax.train.train import main

if __name__ == "__main__":
    main()
