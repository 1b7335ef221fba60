"""Fine-tuning: the loss, LoRA adapters, the optimizer, the train step and train-state checkpoints.
"""
