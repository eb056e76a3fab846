"""The numpydoc sections the estimators' docstrings share, and how they are filled in."""

COMMON_PARAMETERS_DOC = """    alpha : float, default=1e-4
        Regularization strength (>= 0): the penalty is ``alpha *
        (l1_ratio * ||coef||_1 + (1 - l1_ratio) / 2 * ||coef||^2)``.
    penalty : {"l2", "l1", "elasticnet"}, default="l2"
        The penalty on the coefficients (never on the intercept): ``"l2"``
        is ``l1_ratio=0``, ``"l1"`` is ``l1_ratio=1``, ``"elasticnet"``
        takes ``l1_ratio``. With an L1 part the fit reaches the exact
        optimum of that objective by proximal steps (a soft-threshold after
        every step, so ``coef_`` has exact zeros and s is 1; SVRG stops on
        the smallest subgradient), as
        :class:`~sklearn.linear_model.LogisticRegression`'s saga and
        :class:`~sklearn.linear_model.ElasticNet` do, not by
        :class:`~sklearn.linear_model.SGDClassifier`'s truncated gradient.
    l1_ratio : float, default=0.15
        The L1 part's share of ``alpha``, in ``[0, 1]``; read only with
        ``penalty="elasticnet"``.
    fit_intercept : bool, default=True
        Whether to fit an (unpenalized) intercept.
    s : int or "auto", default="auto"
        SGD steps per outer iteration (one reduction each). ``s=1`` is plain
        minibatch SGD. ``"auto"`` picks the s with the smallest predicted
        epoch time: on one device from the device type's cost profile,
        together with the batch size; on several ranks from a cost model
        that the ranks time once per shape and process (see the user
        guide). The choice is reported in ``fit_stats_["s"]``.
        Fewer steps are taken where s L2 decay factors ``1 - eta * alpha``
        would underflow the recurrence (a strong penalty, a long step and a
        large s); the iterates are the same and ``fit_stats_["s"]`` is the
        s used.
    batch_size : int or "auto", default="auto"
        Samples per SGD step; the last batch of an epoch may be smaller.
        ``"auto"`` (SVRG) takes the batch size with the shortest predicted
        time to the optimum: the epochs SVRG needs at that batch size (from
        the data's smoothness, see the user guide) times the epoch's
        predicted time on the device type; the same data gets the same
        batch size in every process. Plain SGD's ``"auto"`` is 32.
        With dense X and every step setting at its default (one device or
        several),
        ``"auto"`` also weighs Newton epochs (full-batch SVRG epochs
        preconditioned by the curvature, a handful to the optimum) and
        takes them where faster: small or narrow data.
        ``fit_stats_["batch_size"]`` is the batch size used and
        ``fit_stats_["plan"]`` the prediction behind it (``"newton"``: whether
        Newton epochs ran).
    solver : {"svrg", "sgd"}, default="svrg"
        ``"svrg"``: variance-reduced SGD (SVRG). Each epoch starts from a
        snapshot whose full pass gives the exact objective, the full gradient
        and a control variate that makes the steps converge linearly to the
        exact optimum; an epoch that does not lower the objective is undone
        and the step halved. ``"sgd"``: plain minibatch SGD, as the CA-SGD
        paper benchmarks; it settles near the optimum, not on it.
        Both take ``s`` steps per reduction. SVRG runs preconditioned: on
        centered columns scaled to a common curvature, so that unscaled X
        does not slow it down (``eta0`` then applies to the scaled problem).
    average : bool or int, default=False
        Averaged SGD (``solver="sgd"`` only), as
        :class:`~sklearn.linear_model.SGDClassifier`'s: ``coef_`` and
        ``intercept_`` are the mean of the iterates (the weights after each
        minibatch step), counted from the start (``True``) or once that
        many samples were stepped on (an int); the steps themselves go on
        from the last iterate, and ``partial_fit`` continues both. The sum
        unrolls in the s-step form like the weights (one more product of
        each outer iteration's rows, no collective).
    learning_rate : {"adaptive", "constant", "invscaling"}, default="adaptive"
        Step-size schedule. ``"constant"`` uses ``eta0``; ``"invscaling"``
        uses ``eta0 / (t + 1) ** power_t`` at step t. ``"adaptive"`` is
        ``"constant"`` for SVRG; for plain SGD it keeps ``eta0`` while the
        training loss improves by at least ``tol`` and divides it by 5 after
        each ``n_iter_no_change`` epochs without improvement, until it falls
        below ``1e-4 * eta0``.
    eta0 : float or "auto", default="auto"
        Initial step size. ``"auto"`` takes it from the data:
        ``1 / L(b)``, with ``L(b)`` the expected smoothness of a minibatch of
        ``batch_size`` rows, between the smoothness of the whole loss and
        that of its worst row (each row's curvature bound {curvature}, times
        its sample weight and class weight, times ``||x_i||^2 +
        fit_intercept``), plus ``alpha``; for SVRG, of the preconditioned
        problem (see the user guide).
    power_t : float, default=0.5
        Exponent of the ``"invscaling"`` schedule.
    max_iter : int, default=1000
        Maximum number of epochs.
    tol : float or None, default=1e-5
        The fit has converged when two tests hold. Where the penalty has an
        L2 part, the certificate: an upper bound on the relative gap to the
        optimum's objective, from every full pass, is at most ``tol / 10``
        (``fit_stats_["gap_bound"]``; the default certifies 1e-6; a float32
        fit whose rounding hides its gap finishes with float64 Newton
        epochs). And the gradient test: the largest absolute entry of the full
        gradient of the objective (coefficients, for SVRG divided by each
        column's spread, as on standardized columns, and intercept) is at
        most ``tol`` times the largest entry at the cold start, with the
        coefficients 0 (a warm start is measured there too), so that the
        units of y do not change the fit; for labels and the gamma
        deviance, which have no units, not below ``tol`` times the mean
        sample weight or 1, whichever is smaller (``tol`` itself with unit
        weights, as lbfgs). ``fit_stats_["gradient_bound"]`` reports the
        bound. SVRG measures it before every
        epoch and stops there; plain SGD measures it once at the end and also uses
        ``tol`` for its plateaus: an epoch improves when its training loss is
        below the best so far minus ``tol``. ``None`` runs ``max_iter``
        epochs. The default is 10x tighter than lbfgs's 1e-4, which stopped
        up to 7e-4 short of the optimum's objective on scikit-learn's digits
        and wine datasets.
    n_iter_no_change : int, default=5
        Plain SGD: epochs without improvement before the schedule reacts
        (see ``learning_rate``) or, for fixed schedules, the fit stops. With
        ``early_stopping``, epochs whose held-out score is not above the best
        so far by ``tol`` before the fit stops (plain SGD with the
        ``"adaptive"`` schedule first divides the step, as
        :class:`~sklearn.linear_model.SGDClassifier` does).
    shuffle : bool, default=True
        Whether to draw a new random order of the samples every epoch.
    random_state : int, RandomState instance or None, default=None
        Seeds the batch order. The same seed draws the same batches for any
        ``s``, ``precision`` and ``n_devices``.
    precision : {"auto", "fp64", "fp32", "bf16", "fp16"}, default="auto"
        Precision policy. ``"bf16"`` stores X and the margins in bfloat16,
        accumulates and returns the Gram in float32 and runs all updates in
        float32; SVRG keeps the margins in float32 (rounded ones leave a
        floor under its gradient). ``"auto"`` is ``"bf16"`` on CUDA devices
        with bfloat16 support and ``"fp32"`` elsewhere.
    device : str, default="auto"
        ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    n_devices : int or "world", default=1
        Ranks to fit on; the features are split into contiguous column blocks,
        one per rank. ``1`` fits in this process. ``k > 1`` fits on the k
        worker processes of a :class:`~sklearn_casgd.WorkerPool` (one per
        GPU on CUDA, gloo over 127.0.0.1 on the CPU): the pool of an
        enclosing ``with WorkerPool(k):`` block, else the process's default
        pool, which the first such fit starts and later fits reuse.
        ``"world"`` spans every rank of the job this process is part of
        (torchrun, SLURM, or a default process group the caller made);
        every rank must call ``fit`` with the same data, and every rank ends
        with the same ``coef_``.
    verbose : int, default=0
        ``1`` shows a progress bar counting epochs with the current training
        loss, step size and (SVRG) the gradient against the stopping test's
        bound, ending at the epochs run (tqdm; one printed line per epoch
        without it). ``0`` is silent. On several ranks only rank 0 reports.
    warm_start : bool, default=False
        Start from the previous solution when refitting.
    timeout : float, default=300.0
        Seconds a distributed fit waits for a rank (to start, or inside a
        collective) before it raises ``DistributedFitError``; at most a week.
    compile : bool or "auto", default="auto"
        Run the s inner steps of each outer iteration through
        ``torch.compile`` (one fused graph, compiled before the epochs; the
        time is reported in ``fit_stats_["compile_seconds"]``, not in
        ``train_seconds``). ``"auto"`` compiles only when an epoch has enough
        outer iterations to repay the compile time (on a CPU about 10^5:
        compiling takes seconds and saves about 0.1 ms per outer iteration),
        and falls back to the eager steps if compiling fails. The compiled
        and eager steps do the same arithmetic. Nothing compiles while
        torch's default cache folder (``<tempdir>/torchinductor_<user>``)
        is another user's or writable by others: ``True`` then raises a
        ``RuntimeError`` naming the folder, ``"auto"`` runs eager with a
        warning.
    early_stopping : bool, default=False
        Set ``validation_fraction`` of the training rows aside (stratified
        by class for classifiers, drawn with ``random_state``), score them
        with the estimator's ``score`` after every epoch, and stop when the
        score has not improved by ``tol`` for ``n_iter_no_change`` epochs;
        the scores are in ``validation_scores_``. The fit then does not warn
        that it did not converge. ``partial_fit`` trains on every row.
    validation_fraction : float, default=0.1
        Fraction of the rows held out when ``early_stopping`` is True, in (0, 1).
    checkpoint_dir : str, path-like or None, default=None
        A directory where ``fit`` writes a checkpoint every
        ``checkpoint_every`` epochs and after its last: each rank's weights
        and the solver's state, each file written whole and renamed into
        place, and a manifest once every rank's file is on disk. A ``fit``
        of the same data and parameters on a directory holding a checkpoint
        resumes it (a job restarted by torchrun's ``--max-restarts``, or a
        new one) and ends with the coefficients the uninterrupted fit
        reaches; ``max_iter`` may differ (a longer fit continues a shorter
        one). A checkpoint of other data, parameters or ranks is refused
        with a ``ValueError`` naming what differs: use one directory per
        fit. With several ranks every rank must see the directory (a
        shared file system across machines). ``partial_fit`` does not
        checkpoint; a pickled estimator is its checkpoint.
    checkpoint_every : int, default=1
        Epochs between checkpoints, with ``checkpoint_dir``.
"""
COMMON_ATTRIBUTES_DOC = """    n_iter_ : int
        Epochs run.
    t_ : int
        SGD steps (minibatch updates) run by the last ``fit`` and the
        ``partial_fit`` calls after it.
    solver_state_ : dict
        Where the solver stands (steps, step size, the batch-order
        generator, plateau counts), from ``SolverState.state_dict()``:
        ``partial_fit`` continues from it, and a pickled estimator is a
        checkpoint.
    validation_scores_ : list of float or None
        The held-out score after each epoch with ``early_stopping``; else None.
    best_validation_score_ : float or None
        The best of ``validation_scores_``; None without ``early_stopping``.
    loss_curve_ : ndarray of shape (n_epochs,)
        Training objective of each epoch: with ``solver="svrg"`` the exact
        objective at the end of the epoch (at the point kept); with
        ``"sgd"`` the mean weighted loss measured along the epoch plus the L2
        penalty at its end.
    fit_stats_ : dict
        What the fit chose and did: ``s``, ``batch_size``, ``precision``,
        ``plan`` (why: ``reason``, the ``predicted_epochs``,
        ``predicted_epoch_seconds`` and ``predicted_seconds`` of the batch
        size and s taken, and each batch size weighed under
        ``candidates``; ``newton``, whether Newton epochs ran, and
        ``newton_candidate``, their predicted epochs and seconds where
        they were weighed, and ``curvature_rows``, the rows their
        curvature is formed from where a sample was weighed faster than
        every row; None where the user set them),
        ``s_predictions`` (the cost model's epoch seconds per candidate s,
        on the fit that decided ``s="auto"``; else None), ``device``,
        ``world_size``, ``n_outer``, ``n_allreduce`` (every
        collective), ``allreduce_bytes``, ``allreduce_seconds`` (rank 0's
        time inside collectives during the epochs, waiting for peers
        included; on CUDA the time its stream waited for them),
        ``train_seconds`` (time in the epoch loop),
        ``epoch_seconds`` (training time at the end of each epoch),
        ``solver``, ``eta0`` (the initial step), ``eta`` (the step at the end),
        ``gradient_max`` (the full gradient's largest absolute entry at the
        end; None with ``solver="sgd"`` and ``tol=None``), ``gradient_bound``
        (``tol`` scaled as that parameter says; None with ``tol=None``),
        ``gap_bound`` (the certificate's upper bound on the relative gap to
        the optimum's objective at the end, or None), ``gap_target`` (``tol
        / 10``, or None without a certificate), ``gap_bound_method`` (how the
        bound was obtained, or why there is none), ``converged`` (whether
        the gradient test and, where there is one, the bound met their
        targets), ``polished_epochs`` (of ``n_iter_``, the float64 Newton
        epochs that finished the fit), ``epochs_run`` (the epochs this call
        ran: ``n_iter_`` less those of a checkpoint it resumed),
        ``exchange`` (``"all-reduce"`` of the Gram blocks, or
        ``"all-gather"`` of the rows where that moves far fewer bytes),
        ``compiled`` (whether the inner
        steps ran compiled), ``compile_seconds``, ``execution`` (how the
        epochs ran: ``steps`` ``"rows"``, ``"gram"`` or ``"newton"``, the
        ``exchange``, and whether the Triton kernels ran them, ``fused``,
        ``epoch_kernel``, ``fused_pass``, ``compiled`` and ``graphs``) and
        ``stopped_early`` (whether the held-out score ended the fit).
    n_features_in_ : int
        Number of features seen during fit.
    feature_names_in_ : ndarray of shape (n_features,)
        Feature names, when X has string column names.
"""


PARTIAL_FIT_DOC = """One epoch of the solver on a chunk of samples, continuing the previous fit.

        The first call (on an unfitted estimator) takes its intercept start,
        its preconditioner (SVRG) and its step size from its chunk, the step
        as for a stream of which the chunk is a sample; later calls continue
        the coefficients, the step-size schedule, the step count and the
        batch-order generator (see ``solver_state_``). Chunks walked in order
        with ``shuffle=False`` take the same steps as one epoch of ``fit``
        over their concatenation. ``max_iter``, ``tol`` and
        ``early_stopping`` do not apply. SVRG takes its snapshot over the
        chunk and does not lengthen its step: use ``solver="sgd"`` for plain
        SGD.

        Parameters
        ----------
        X : {{array-like, sparse matrix}} of shape (n_samples, n_features)
            A chunk of training data.
{targets}
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights multiplying each sample's loss.

        Returns
        -------
        self : object
            Fitted estimator.
        """


def fill_docstring(doc: str, curvature: str) -> str:
    """Insert the shared parameter and attribute sections into an estimator docstring."""
    parameters = COMMON_PARAMETERS_DOC.replace("{curvature}", curvature)
    return doc.replace("    {common_parameters}\n", parameters).replace(
        "    {common_attributes}\n", COMMON_ATTRIBUTES_DOC
    )
