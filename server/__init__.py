"""The data server: sources, ordering, sessions, the serving loop and the ``fuelline`` CLI."""

from fuelline.server.ingest.tables import write_dataset
from fuelline.server.serving.server import Server
from fuelline.server.serving.start import start_server
from fuelline.server.sources.contract import BatchSource
from fuelline.server.sources.fuel import FuelStreamSource
from fuelline.server.sources.parquet import ParquetSource

__all__ = ["BatchSource", "Server", "start_server", "ParquetSource", "FuelStreamSource", "write_dataset"]
