"""How an app's training job is declared (`spec.TrainSpec`) and built into the platform `Trainer`."""
