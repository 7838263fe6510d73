"""torch.optim's Adam as this library reads it: ``cpu_adam.CPUAdam`` (a ``torch.optim.Optimizer`` over the C++
kernel), ``flags`` (the group keys CPUAdam and the engines read alike) and ``state_dict`` (CPUAdam's state dicts).

Importing the package loads no optimizer: the engines import ``flags`` alone.
"""
