"""Loading a trained model, export, evaluate and predict."""
