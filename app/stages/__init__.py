"""The background stages after ingest, in pipeline order: compression, then
distribution (batches) and delivery. Each is a `worker.PipelineStage`."""
