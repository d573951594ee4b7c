"""The recovery app's edges to the world outside the database: the copy-back backend
(`copyback`), the deployment worker platform and its stop proofs (`platform`), and the
identity of the controller process on this host (`identity`)."""
