"""AstraFlow weights: the sparse delta codec (:mod:`weights.codec`), the versioned object
store (:mod:`weights.store`), the trainer-side publisher (:mod:`weights.publisher`) and the
RaaS-side puller (:mod:`weights.puller`)."""
