"""scikit-learn front-ends of the CA-SGD engine."""
