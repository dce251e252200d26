"""Engine replicas on Ray Serve behind one ingress (``firsttoken serve-ray``: app.py, replica.py,
ingress.py, fleet.py, router.py, routing.py, metrics.py, autoscale.py); their engines and
processors come from the one assembly (firsttoken/assembly.py). Only the Ray modules import Ray."""
