"""Batched multi-LoRA serving in the engine: the adapters' tensors (`weights.py`, read from the PEFT
directories `pipeserve/lora.py` validates), the host-memory LRU (`host.py`), the device-resident slot
table (`slots.py`), who holds which slot (`manager.py`: the scheduler asks it before admitting a
request), the step's row -> slot index (`rows.py`) and the linear layers that add the adapters'
products (`layer.py`, through the backend's `add_lora`)."""
