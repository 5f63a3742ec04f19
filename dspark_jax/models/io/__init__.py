"""Checkpoint I/O (SPEC §2 targets, §3, §5 drafters): Hugging Face targets (`hf`), the embedded
GGUF target (`gguf`; written as a Hugging Face directory by `gguf_to_hf`), DeepSpec drafters
(`deepspec`), vLLM speculators drafters (`speculators`), a drafter's confidence-calibration file
(`calibration_file`), and the one checkpoint error type (`errors.CheckpointError`).
"""
