"""Placement: which devices host the towers and where variables live.

Device strings, their validation, GPU discovery and the CPU fallback
(`devices`); the towers only on devices the session will have
(`session_devices`); the variable strategies (`strategies`: `cpu`, `gpu`,
`replicated`, `collective`), small classes behind one `Placement`
interface, picked from a dict: where each new variable goes, where a
variable's gradients are summed, whether towers read replicas.

May import: base, cluster.
"""
