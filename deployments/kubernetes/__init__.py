"""Render, validate, apply, follow and delete the multi-node training JobSet of a Kubernetes work pool.

A flow run is one process, so training on N nodes is a gang of pods the provision task submits: one
**JobSet** (jobset.x-k8s.io) per run, whose one replicated Job is an Indexed Job with a pod per node,
each running ``torchrun`` into one c10d rendezvous at pod 0. The JobSet gives what a bare Job does
not: the headless Service for pod DNS, a restart-all failure policy with ``maxRestarts`` (a lost
node restarts the whole gang, a user error fails it at once), exclusive placement of the gang in one
topology domain (a TPU slice, an EFA node group), and, with ``cluster.queue``, admission of the whole
gang by **Kueue**. A ConfigMap holds the trainer's job JSON; it is owned by the JobSet, and the JobSet
by the flow run's own Job when the flow runs in the cluster, so the garbage collector removes both
with the flow run; a TTL and a deadline bound them otherwise.

With ``faults.replica_fault_tolerance`` the replicated Job has one Job per replica group (each its own
rendezvous at its pod 0), a second replicated Job runs the run's torchft Lighthouse, and a failed
replica's Job is recreated alone (JobSet's ``RestartJob``, alpha in v0.12: the operator must run with
``--feature-gates=RestartJob=true``), so the other replicas keep training.

The pod shape comes from the pool's base job template (``deployments/templates/<accelerator>.json``),
so the pool and the training job share one source of truth; the spec fills in image, chip counts,
instance type, TPU slice topology, service account and queue. Objects are named after the run id, so
a retried provision finds (and replaces) the same objects, and two runs of one spec never collide.

``render`` builds and validates the objects (pure functions of a run, no API server);
``client`` applies, follows and deletes them through the Kubernetes API.
"""
