"""Built-in worker functions (``spawn_train(TrainConfig(...))`` runs ``classification.train``)."""
