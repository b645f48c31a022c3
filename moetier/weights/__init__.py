"""The container format: manifest, dense safetensors, expert records and index, reader and
writer, and quantization (docs/internals.md, 'The container')."""

from __future__ import annotations

from moetier.weights.container import Container
from moetier.weights.index import ExpertIndex, RecordLocation
from moetier.weights.layout import PartLayout, RecordLayout
from moetier.weights.writer import ContainerWriter

__all__ = ["Container", "ContainerWriter", "ExpertIndex", "PartLayout", "RecordLayout", "RecordLocation"]
