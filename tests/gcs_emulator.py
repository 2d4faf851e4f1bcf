"""A local Google Cloud Storage server for the tests of gs:// workdirs: gcp-storage-emulator (PyPI, BSD
licence) serving the JSON API from memory on a free port of 127.0.0.1, in a thread of the test's process.

Both clients of the store talk to it: tensorstore (Orbax's arrays) through ``TENSORSTORE_GCS_HTTP_URL`` and
``GOOGLE_AUTH_TOKEN_FOR_TESTING``, gcsfs (etils.epath's ``gs://``) and google-cloud-storage (tensorboardX's
event files) through ``STORAGE_EMULATOR_HOST``; ``point_clients_at(url, monkeypatch)`` sets them for one test.

What the emulator lacks is added here, not in the product: an upload with ``ifGenerationMatch=0`` (create
only if absent: gcsfs's ``mode="create"``, which the workdir lock uses, and tensorstore's first writes) is
refused with 412 when the object exists. Other generation preconditions are not checked (one writer per
object in these tests). A client that closes its connection before reading the whole answer (gcsfs
reading a byte range) is not reported as an error.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http import HTTPStatus, server

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.handlers.buckets import create_bucket
from gcp_storage_emulator.storage import Storage


def _insert_if_absent(request, response, storage, *args, **kwargs):
    """The emulator's object upload, refused with 412 when it asks ``ifGenerationMatch=0`` of an object that
    exists (the name is in the query, or in a multipart upload's metadata)."""
    if request.query.get("ifGenerationMatch") == ["0"] and "upload_id" not in request.query:
        name = request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")
        try:
            storage.get_file_obj(request.params["bucket_name"], name)
        except NotFound:
            pass
        else:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you specified "
                                                             "did not hold."}})
            return None
    return objects.insert(request, response, storage, *args, **kwargs)


class _Server(server.HTTPServer):
    """One request at a time (the emulator's storage is not thread-safe)."""

    def handle_error(self, request, client_address):
        pass  # a client that hung up early (the answer is not needed)


@contextlib.contextmanager
def gcs_emulator(*buckets: str) -> Iterator[str]:
    """A running emulator holding the empty ``buckets``; yields its URL (``http://127.0.0.1:PORT``) and
    stops it on exit (its routes restored)."""
    routes = [handlers for _, handlers in emulator.HANDLERS if handlers.get(emulator.POST) is objects.insert]
    storage = Storage(use_memory_fs=True)
    for name in buckets:
        create_bucket(name, storage)
    httpd = _Server(("127.0.0.1", 0), lambda *args: emulator.RequestHandler(storage, *args))
    thread = threading.Thread(target=httpd.serve_forever, name="gcs-emulator", daemon=True)
    for handlers in routes:
        handlers[emulator.POST] = _insert_if_absent
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        for handlers in routes:
            handlers[emulator.POST] = objects.insert


def point_clients_at(url: str, monkeypatch) -> None:
    """Send tensorstore's, gcsfs's and google-cloud-storage's requests for ``gs://`` to ``url``."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test")  # tensorstore: no credentials looked up
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
