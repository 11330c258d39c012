"""`python benchmarks/gpu_check.py [--dry-run] OUT`: the prepared GPU run (the `gpu_check`
package next to this file; docs/howto/gpu-check.md). Run as a script, this folder is first on
`sys.path`, so `gpu_check` is the package (a package wins over a module of its name)."""

import sys

from gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
