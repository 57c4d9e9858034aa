"""DiLoCo / local SGD, driver side (``--mode diloco``)."""
