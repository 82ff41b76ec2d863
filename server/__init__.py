"""The data server: sources, ordering, sessions, the serving loop and the ``fuelline`` CLI."""

from fuelline.server.fuel_source import FuelStreamSource
from fuelline.server.parquet_source import ParquetSource
from fuelline.server.serving import Server
from fuelline.server.start import start_server

__all__ = ["Server", "start_server", "ParquetSource", "FuelStreamSource"]
