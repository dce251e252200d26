"""How a firsttoken server is assembled from the config tree: one engine in the process
(``build.py``, what ``firsttoken serve`` runs), or engine replicas on Ray Serve behind one ingress
(``firsttoken serve-ray``: app.py, replica.py, ingress.py, fleet.py, router.py, routing.py,
metrics.py). Only the Ray modules import Ray."""
