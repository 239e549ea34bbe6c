"""The embedded broker: kombu's filesystem transport, with messages written atomically.

kombu's filesystem transport creates a message file and then writes it; a consumer that
lists the folder in between moves and reads an empty file, fails to decode it and the
worker stops (seen here under load). This transport writes each message under a name
consumers ignore and renames it into place, so a consumer sees a whole message or none.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

__all__ = ["TRANSPORT", "Channel", "Transport"]

#: What Celery's ``broker_transport`` names to use this transport.
TRANSPORT = "workers.broker:Transport"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` on ``queue``: write a hidden temp file, then rename it into the queue."""
        # Same name scheme as kombu's (time-ordered, then the queue), so _get finds it.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # A leading dot: partition('.') gives no queue match, so consumers skip it.
        tmp = os.path.join(self.data_folder_out, f".tmp-{name}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(str_to_bytes(dumps(payload)))
            os.rename(tmp, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
