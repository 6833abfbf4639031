"""The background stages after ingest, in pipeline order: compression, then
distribution (batches) and delivery. Each is a `worker.PipelineStage`."""

from app.domain import ELIGIBLE, Stage

# The names the runner wakes these stages by. Here, apart from their modules: `atropos
# serve` wires an ingest commit's wake-up (app/hub.py) before it imports those.
COMPRESSION = "compression"
DISTRIBUTION = "distribution"
DELIVERY = "delivery"
# The stage that takes a trace on from where it entered (EntryStage,
# app/ingest/ingestor.py): an ingest commit wakes only those its traces need. A trace
# entered rejected or below the threshold needs none.
TAKES_ON: dict[str, str] = {Stage.ACCEPTED.value: COMPRESSION,
                            **{stage.value: DISTRIBUTION for stage in ELIGIBLE}}
