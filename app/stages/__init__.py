"""The background stages after ingest, in pipeline order: compression, then
distribution (batches) and delivery. Each is a `worker.PipelineStage`."""

# The names the runner wakes these stages by. Here, apart from their modules: `atropos
# serve` wires an ingest commit's wake-up (app/hub.py) before it imports those.
COMPRESSION = "compression"
DISTRIBUTION = "distribution"
DELIVERY = "delivery"
# The stages an ingest commit gives work to: a trace enters before compression, or past
# it before distribution (EntryStage, app/ingest/ingestor.py).
ENTERED = (COMPRESSION, DISTRIBUTION)
