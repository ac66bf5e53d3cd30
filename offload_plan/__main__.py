"""``python -m offload_plan``: the same command line as the ``offload-plan`` script."""

from offload_plan.app import main

if __name__ == "__main__":
    main()
