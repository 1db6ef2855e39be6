"""Capacity tools: what a model would do on a GPU, modelled rather than measured. The GPU table
(`gpus.py`), the roofline cost model and `pipeserve roofline` (`roofline.py`), the serving simulator
(`simulator.py`) behind `pipeserve simulate` (`simulate.py`) and its data x tensor parallel variant
(`parallel.py`), and the predicted-KV study (`predicted_kv.py`). Measurements are pipeserve.bench."""
