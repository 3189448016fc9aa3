"""Service control: relaunch the SGLang server with candidate flags (systemd or a plain process)."""
