"""The model and GPU catalog the cost models price with: ModelSpec and GPUSpec records and the KV
capacity they imply (specs.py), the GPUs beyond the presets (gpus.py), Hugging Face config.json
files read into ModelSpecs (hf_config.py, shipped files in models/)."""
