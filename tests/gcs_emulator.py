"""A local Google Cloud Storage server for the tests of gs:// workdirs: gcp-storage-emulator (PyPI, BSD
licence) serving the JSON API from memory on a free port of 127.0.0.1, in a thread of the test's process.

Both clients of the store talk to it: tensorstore (Orbax's arrays) through ``TENSORSTORE_GCS_HTTP_URL`` and
``GOOGLE_AUTH_TOKEN_FOR_TESTING``, gcsfs (etils.epath's ``gs://``) and google-cloud-storage (tensorboardX's
event files) through ``STORAGE_EMULATOR_HOST``; ``point_clients_at(url, monkeypatch)`` sets them for one test.

What the emulator lacks of GCS is added here, not in the product:
- an upload's ``ifGenerationMatch=N`` is checked, refused with 412 unless the object's generation is N
  (0: the object must not exist; gcsfs's ``mode="create"``, which the workdir lock uses; tensorstore's
  OCDBT, Orbax's arrays, updates its manifest with such conditional writes);
- an object's media read carries its generation (``x-goog-generation``, ``x-goog-metageneration``), and
  ``ifGenerationNotMatch`` of the current generation is answered 304. Without these headers the trainer
  CLI against the emulator served from a process of its own (``python -c 'with gcs_emulator("bucket")
  as url: ...'``) failed its first checkpoint with tensorstore's "Malformed StorageGeneration"; with them
  it trains, stops on Ctrl-C, resumes and is evaluated. (tests/test_remote_paths.py's run, with the
  emulator in a thread of the test's process, passed either way.)
A client that closes its connection before reading the whole answer (gcsfs reading a byte range) is
not reported as an error.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from http import HTTPStatus, server

from gcp_storage_emulator import server as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.handlers.buckets import create_bucket
from gcp_storage_emulator.storage import Storage


def _insert_if_generation_matches(request, response, storage, *args, **kwargs):
    """The emulator's object upload, refused with 412 when it asks ``ifGenerationMatch=N`` and the object's
    generation is not N (0 when it does not exist; the name is in the query, or in a multipart upload's
    metadata)."""
    if "ifGenerationMatch" in request.query and "upload_id" not in request.query:
        name = request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")
        try:
            generation = int(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
        except NotFound:
            generation = 0
        if generation != int(request.query["ifGenerationMatch"][0]):
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you specified "
                                                             "did not hold."}})
            return None
    return objects.insert(request, response, storage, *args, **kwargs)


def _media_with_generation(original, request, response, storage, *args, **kwargs):
    """The emulator's object read ``original`` (``objects.get``, a media read with ``alt=media``, or
    ``objects.download``), a media read with what GCS adds and tensorstore reads: the object's
    generation in ``x-goog-generation`` (and metageneration), and 304 with no body when
    ``ifGenerationNotMatch`` names the current generation (a cached copy still valid)."""
    if original is objects.get and request.query.get("alt") != ["media"]:  # its metadata (JSON)
        return original(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return objects.download(request, response, storage, *args, **kwargs)
    if request.query.get("ifGenerationNotMatch") == [str(obj["generation"])]:
        response.status = HTTPStatus.NOT_MODIFIED
    else:
        objects.download(request, response, storage, *args, **kwargs)
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
    return None


class _Server(server.HTTPServer):
    """One request at a time (the emulator's storage is not thread-safe)."""

    def handle_error(self, request, client_address):
        pass  # a client that hung up early (the answer is not needed)


@contextlib.contextmanager
def gcs_emulator(*buckets: str) -> Iterator[str]:
    """A running emulator holding the empty ``buckets``; yields its URL (``http://127.0.0.1:PORT``) and
    stops it on exit (its routes restored)."""
    routes = [handlers for _, handlers in emulator.HANDLERS if handlers.get(emulator.POST) is objects.insert]
    reads = [handlers for _, handlers in emulator.HANDLERS
             if handlers.get(emulator.GET) in (objects.get, objects.download)]
    originals = [handlers[emulator.GET] for handlers in reads]
    storage = Storage(use_memory_fs=True)
    for name in buckets:
        create_bucket(name, storage)
    httpd = _Server(("127.0.0.1", 0), lambda *args: emulator.RequestHandler(storage, *args))
    thread = threading.Thread(target=httpd.serve_forever, name="gcs-emulator", daemon=True)
    for handlers in routes:
        handlers[emulator.POST] = _insert_if_generation_matches
    for handlers, original in zip(reads, originals):
        handlers[emulator.GET] = functools.partial(_media_with_generation, original)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
        for handlers in routes:
            handlers[emulator.POST] = objects.insert
        for handlers, original in zip(reads, originals):
            handlers[emulator.GET] = original


def point_clients_at(url: str, monkeypatch) -> None:
    """Send tensorstore's, gcsfs's and google-cloud-storage's requests for ``gs://`` to ``url``."""
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "test")  # tensorstore: no credentials looked up
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
