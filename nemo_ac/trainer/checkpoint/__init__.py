"""What a run writes and reads besides the loop: DCP checkpoints and their directory layout, the end-of-run and
``nemo-ac export`` Hugging Face exports, and Hugging Face safetensors load and export through the
``nemo_ac.config.hf`` mapping.

- ``files``: the checkpoint directory layout and its checks (pure, no torch: ``preflight`` reads it);
- ``dcp``: ``Checkpointer`` and ``TrainingState`` (model, optimizer, scheduler, data position, RNG) over DCP;
- ``export``, ``export_files``, ``export_target``: a DCP step -> an HF directory, and where it may be written;
- ``hf_weights``: pretrained weights in at start, the final HF export out at the end;
- ``hf_safetensors``, ``hf_sharded_io``: safetensors <-> nemo_ac models, each rank reading its own slices.

Importing the package imports none of them, so ``preflight`` can read ``files`` without torch.
"""
