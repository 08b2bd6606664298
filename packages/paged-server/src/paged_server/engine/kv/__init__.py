"""The KV cache as the engine sizes and builds it: the factory, sizing, calibration of KV scales, host/disk tiers."""
