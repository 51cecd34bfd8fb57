"""``python -m nemo_ac.doctor`` (same as ``nemo-ac doctor``)."""

from nemo_ac.doctor.runner import main

if __name__ == "__main__":
    from nemo_ac.runtime import exit_process  # no interpreter teardown (see its docstring)

    exit_process(main())
