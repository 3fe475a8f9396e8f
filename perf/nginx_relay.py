"""The floor under any relay on this machine: nginx, one worker, passing streams through unbuffered.

perf/gateway_overhead.py runs it beside the gateway and perf/relay_floor.py when an nginx binary
is found (`PERF_NGINX`, else `nginx` on the PATH or /usr/sbin/nginx; Debian: `apt-get install
nginx-light`). It is a relay written in C with no key, quota or usage, one process like the
gateway, keeping its upstream connections alive and sending each chunk on as it arrives
(`proxy_buffering off`). What it adds over calling the upstream directly is what one more hop
costs on this machine whatever the language: the two cores it shares with the client and the
upstream, and one more process to wake per request and per chunk. The gap between it and
relay_floor.py is what Python costs; the gap between relay_floor.py and the gateway is the
portal's own work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from devtools import free_port, wait_for_http
from perf._common import spawn
from perf._world import log_file

CONFIG = """\
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {directory}/body;
  proxy_temp_path {directory}/proxy;
  fastcgi_temp_path {directory}/fastcgi;
  uwsgi_temp_path {directory}/uwsgi;
  scgi_temp_path {directory}/scgi;
  upstream engine {{ server {upstream}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def nginx_binary() -> str | None:
    """The nginx to run, or None when this machine has none."""
    named = os.environ.get("PERF_NGINX")
    if named:
        if not os.access(named, os.X_OK):
            raise SystemExit(f"PERF_NGINX={named}: not an executable file")
        return named
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def start_nginx(
    binary: str, upstream: str, directory: Path, processes: list[subprocess.Popen]
) -> tuple[str, subprocess.Popen]:
    """nginx in the foreground in front of `upstream` (http://host:port), its files under
    `directory/nginx`, up and relaying: (its URL, its process), which joins `processes` (the
    caller stops them) as it starts."""
    home = directory / "nginx"
    home.mkdir()
    port = free_port()
    config = home / "nginx.conf"
    config.write_text(CONFIG.format(directory=home, upstream=upstream.split("//", 1)[1], port=port))
    process = spawn(
        [binary, "-p", str(home), "-c", str(config), "-g", "daemon off;"],
        stdout=log_file(directory, "nginx"),
        stderr=subprocess.STDOUT,
    )
    processes.append(process)
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/health", watch=process, timeout_s=60)  # the fake upstream's health, through nginx
    return url, process
