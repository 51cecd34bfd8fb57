"""``nemo-ac doctor``: which torch 2.12 / 2.13 FSDP2 + SAC + compile failures the installed torch has, and whether
nemo_ac's workarounds (``nemo_ac.compat``) fix each one there.

``nemo_ac.doctor.runner.run_doctor()`` runs the probes (``PROBES`` there) and returns a ``DoctorReport``;
``nemo_ac.doctor.args`` holds the command-line options and imports no torch, so ``nemo-ac --help`` stays fast.
"""
