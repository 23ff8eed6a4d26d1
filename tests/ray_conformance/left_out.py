"""Ray Train's public-API tests that the conformance run leaves out, each with its reason: it reaches
into Ray's internals, or it asserts something we do differently on purpose (README, "Coming from Ray
Train"). None is here because it fails. Keys are pytest node ids (a prefix deselects every
parametrization)."""

from __future__ import annotations

_INTERNALS = "reaches into Ray's internals"
_FSSPEC = ("the filesystems elastic_train hands out (Result.filesystem, Checkpoint.filesystem, "
           "get_storage().storage_filesystem) are fsspec's, one library for the runtime and the loop; pyarrow's are "
           "taken wherever Ray takes them")
_URL = ("on purpose: the Result.path of a run in an object store is its URL (s3://bucket/run), which "
        "Result.from_path opens by itself; Ray's is the path on Result.filesystem, which this test asserts")

_NOT_IN = "tests what Ray 2.60 does not have: {}".format
_GPUS = "needs GPUs (CI has none); elastic_train on NCCL is tests/test_gpu.py"
_OTHER = ("on purpose: a trainer for another framework; elastic_train trains PyTorch (importing one of Ray's other "
          "trainers says so: UnsupportedAPIError)")

_V1 = ("Ray Train V1's internals ({}); V2, which elastic_train follows, replaced them").format
_PREDICTOR = _NOT_IN("ray.train.predictor (Ray's predictors were removed before 2.60)")

# Ray Train's test files not run (paths under python/ray/train), each with its reason; the files run are
# __main__.py's FILES.
LEFT_OUT_FILES: dict[str, str] = {
    "v2/tests/test_async_checkpointing_validation.py": _NOT_IN("ray.train.v2.api.report_config.ValidationConfig"),
    "v2/tests/test_accelerator_utils.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks.accelerators, ...)",
    "v2/tests/test_autoscaling_coordinator_client.py":
        _INTERNALS + " (ray.train.v2._internal.constants, ...)",
    "v2/tests/test_callback_manager.py":
        _INTERNALS + " (ray.train.v2._internal.execution.callback, ...)",
    "v2/tests/test_checkpoint_handler.py":
        _INTERNALS + " (ray.train._internal.session, ...)",
    "v2/tests/test_checkpoint_manager.py":
        _INTERNALS + " (ray.train._internal.session, ...)",
    "v2/tests/test_circular_import_linter.py": _INTERNALS + " (ray.train.lint.check_circular_imports)",
    "v2/tests/test_circular_imports.py": "Ray's own import graph (ours is tests/test_import_graph.py)",
    "v2/tests/test_collectives.py":
        "ray.train.collectives is not in Ray 2.60 (it is ray.train.collective there: test_collective.py runs)",
    "v2/tests/test_context.py":
        _INTERNALS + " (ray.train.v2._internal.execution.context, ...)",
    "v2/tests/test_controller.py":
        _INTERNALS + " (ray.train.v2._internal.constants, ...)",
    "v2/tests/test_controller_callback_behaviour.py":
        _INTERNALS + " (ray.train.v2._internal.execution.context, ...)",
    "v2/tests/test_data_config.py":
        _INTERNALS + " (ray.train._internal.data_config, ...)",
    "v2/tests/test_data_integration_replica_replacement.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks.datasets, ...)",
    "v2/tests/test_data_resource_cleanup.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks.datasets, ...)",
    "v2/tests/test_dataset_checkpointing.py": _NOT_IN("ray.train.DatasetCheckpointConfig"),
    "v2/tests/test_dataset_manager.py":
        _INTERNALS + " (ray.data._internal.iterator.stream_split_iterator, ...)",
    "v2/tests/test_elastic_e2e.py": _INTERNALS + " (ray.train.v2._internal.constants)",
    "v2/tests/test_elastic_scaling_policy.py":
        _INTERNALS + " (ray.train.v2._internal.execution.callback, ...)",
    "v2/tests/test_env_callbacks.py":
        _INTERNALS + " (ray.train.v2._internal.constants, ...)",
    "v2/tests/test_failure_policy.py":
        _INTERNALS + " (ray.train.v2._internal.exceptions, ...)",
    "v2/tests/test_health.py": _NOT_IN("the health framework, ray.train.health"),
    "v2/tests/test_health_callback.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks, ...)",
    "v2/tests/test_health_collective_join.py":
        _INTERNALS + " (ray.train.v2._internal.execution.health.decision, ...)",
    "v2/tests/test_health_contracts.py": _NOT_IN("the health framework, ray.train.health"),
    "v2/tests/test_health_controller.py":
        _INTERNALS + " (ray.train.v2._internal.execution.callback, ...)",
    "v2/tests/test_health_diagnose_flow.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks.nccl_ras, ...)",
    "v2/tests/test_health_diagnostics.py": _INTERNALS + " (ray.train.health._internal.on_demand)",
    "v2/tests/test_health_fault_discrimination.py":
        _INTERNALS + " (ray.train.v2._internal.execution.health, ...)",
    "v2/tests/test_health_fault_injection.py":
        _INTERNALS + " (ray.train.v2._internal.execution.health.report, ...)",
    "v2/tests/test_health_manager.py": _INTERNALS + " (ray.train.health._internal.manager)",
    "v2/tests/test_health_nccl_ras_port.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks.nccl_ras, ...)",
    "v2/tests/test_health_node_exclusion.py": _INTERNALS + " (ray.train.health._internal.callback)",
    "v2/tests/test_health_node_monitor.py": _INTERNALS + " (ray.train.health._internal.node_monitor)",
    "v2/tests/test_health_real_captures.py": _NOT_IN("the health framework's NCCL-RAS captures"),
    "v2/tests/test_health_udf_signals.py":
        _INTERNALS + " (ray.train.v2._internal.execution.health.report, ...)",
    "v2/tests/test_jax_elastic_e2e.py": _INTERNALS + " (ray.train.v2._internal.constants)",
    "v2/tests/test_jax_gpu.py": _GPUS,
    "v2/tests/test_jax_trainer.py": _OTHER,
    "v2/tests/test_lightgbm_trainer.py": _OTHER,
    "v2/tests/test_local_mode.py":
        _OTHER + "; it imports lightgbm, xgboost, scikit-learn and transformers' Hub models at its top (local "
                 "mode leaving no Ray instance behind is tests/test_ray_forms.py)",
    "v2/tests/test_local_running_utils.py":
        _INTERNALS + " (ray._private.test_utils, ...)",
    "v2/tests/test_local_testing_context.py":
        _INTERNALS + " (ray.train.v2._internal.execution.context, ...)",
    "v2/tests/test_logging.py":
        _INTERNALS + " (ray._private, ...)",
    "v2/tests/test_metrics.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks.metrics, ...)",
    "v2/tests/test_mlflow_callback.py": _NOT_IN("the MLflow callback"),
    "v2/tests/test_nccl_ras_callback.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks, ...)",
    "v2/tests/test_nccl_ras_hang_detection.py": _GPUS,
    "v2/tests/test_nv_hang_detector_callback.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks, ...)",
    "v2/tests/test_nv_hang_detector_detection.py": _GPUS,
    "v2/tests/test_pg_cleaner.py": _INTERNALS + " (ray.train.v2._internal.execution.controller.pg_cleaner)",
    "v2/tests/test_pg_cleaner_callback.py":
        _INTERNALS + " (ray.train.v2._internal.execution.controller.pg_cleaner_callback, ...)",
    "v2/tests/test_placement_group_cleaner.py":
        _INTERNALS + " (ray.train.v2._internal.execution.controller.placement_group_cleaner)",
    "v2/tests/test_placement_group_handle.py":
        _INTERNALS + " (ray.train.v2._internal.execution.worker_group.placement_group_handle)",
    "v2/tests/test_preemption_fault_tolerance.py":
        _INTERNALS + " (ray.train.v2._internal.execution.context, ...)",
    "v2/tests/test_preemption_unit.py":
        _INTERNALS + " (ray.train.v2._internal.callbacks, ...)",
    "v2/tests/test_preemption_watcher.py": _INTERNALS + " (ray.train.v2._internal.execution.preemption)",
    "v2/tests/test_report_fault_tolerance.py": _INTERNALS + " (ray.train.v2._internal.execution.checkpoint.sync_actor)",
    "v2/tests/test_report_handler.py":
        _INTERNALS + " (ray.train.v2._internal.execution.context, ...)",
    "v2/tests/test_state.py":
        _INTERNALS + " (ray.train.v2._internal.exceptions, ...)",
    "v2/tests/test_state_export.py":
        _INTERNALS + " (ray._private, ...)",
    "v2/tests/test_storage.py":
        _INTERNALS + " (ray.train.v2._internal.constants, ...)",
    "v2/tests/test_sync_actor.py":
        _INTERNALS + " (ray.train.v2._internal.exceptions, ...)",
    "v2/tests/test_telemetry.py": _INTERNALS + " (ray._common.usage, ...)",
    "v2/tests/test_tensorflow_trainer.py": _OTHER,
    "v2/tests/test_thread_runner.py":
        _INTERNALS + " (ray.train.v2._internal.util, ...)",
    "v2/tests/test_torch_gpu.py": _GPUS,
    "v2/tests/test_torch_transformers_train.py":
        "it downloads a model from the Hugging Face Hub (no network here); Transformers on elastic_train is "
        "tests/test_transformers.py",
    "v2/tests/test_tpu_utils.py": _NOT_IN("ray.train.v2.jax.tpu_utils"),
    "v2/tests/test_train_annotations.py":
        _INTERNALS + " (ray.train.v2._internal, ...)",
    "v2/tests/test_trainer.py": "written for the 2022 ray.ml API: it imports on no current Ray",
    "v2/tests/test_util.py": _INTERNALS + " (ray.train.utils._in_ray_train_worker)",
    "v2/tests/test_validation_manager.py":
        _INTERNALS + " (ray.train._checkpoint, ...)",
    "v2/tests/test_worker.py":
        _INTERNALS + " (ray.train.v2._internal.constants, ...)",
    "v2/tests/test_worker_group.py":
        _INTERNALS + " (ray._private.state, ...)",
    "v2/tests/test_worker_group_poll_status.py": _INTERNALS + " (ray.train.v2._internal.execution.worker_group.poll)",
    "v2/tests/test_worker_group_v2.py":
        _INTERNALS + " (ray.train.v2._internal.constants, ...)",
    "v2/tests/test_xgboost_trainer.py": _OTHER,
    "tests/test_api_migrations.py": _INTERNALS + " (ray.train.v2._internal.constants: the V1/V2 switch)",
    "tests/test_backend.py": _V1("ray.train._internal.backend_executor, worker_group"),
    "tests/test_base_trainer.py": _V1("ray.train._internal.session"),
    "tests/test_base_worker_group.py": _V1("ray.train._internal.worker_group"),
    "tests/test_checkpoint.py": _INTERNALS + " (ray.train._checkpoint, ray.train._internal.storage)",
    "tests/test_checkpoint_manager.py": _V1("ray.train._internal.checkpoint_manager"),
    "tests/test_data_parallel_trainer.py": _V1("ray.train._internal.backend_executor, worker_group"),
    "tests/test_data_parallel_trainer_checkpointing.py":
        "it tests V1's DataParallelTrainer (ray.train.data_parallel_trainer), which Ray 2.60 refuses on V2 "
        "(DeprecationWarning: 'not compatible with Ray Train V2')",
    "tests/test_e2e_wandb_integration.py": _INTERNALS + " (ray.air.tests.mocked_wandb_integration)",
    "tests/test_examples.py":
        "it imports Ray's TensorFlow examples at its top (no TensorFlow here; elastic_train trains PyTorch), so it "
        "stops at collection on both; Ray's PyTorch example runs in tests/test_ray_conformance.py",
    "tests/test_gpu.py": _GPUS,
    "tests/test_gpu_2.py": _GPUS,
    "tests/test_gpu_auto_transfer.py": _GPUS,
    "tests/test_gpu_examples.py": _GPUS,
    "tests/test_horovod_trainer.py": _OTHER,
    "tests/test_iter_torch_batches_gpu.py": _GPUS,
    "tests/test_lightgbm_predictor.py": _PREDICTOR,
    "tests/test_lightgbm_trainer.py": _OTHER,
    "tests/test_minimal.py": _V1("ray.train._internal.worker_group"),
    "tests/test_new_persistence.py": _V1("ray.train._internal.session, storage"),
    "tests/test_predictor.py": _PREDICTOR,
    "tests/test_result.py": _INTERNALS + " (ray.air._internal.uri_utils); V2's test_result.py runs",
    "tests/test_session.py": _V1("ray.train._internal.session"),
    "tests/test_state.py": _V1("ray.train._internal.state"),
    "tests/test_state_export.py": _V1("ray.train._internal.state.export"),
    "tests/test_storage.py": _V1("ray.train._internal.storage"),
    "tests/test_telemetry.py": _INTERNALS + " (ray._common.usage)",
    "tests/test_tensorflow_checkpoint.py": _OTHER,
    "tests/test_tensorflow_predictor.py": _PREDICTOR,
    "tests/test_tensorflow_trainer.py": _OTHER,
    "tests/test_torch_detection_predictor.py": _PREDICTOR,
    "tests/test_torch_device_manager.py": _INTERNALS + " (ray.air._internal.device_manager); and GPUs",
    "tests/test_torch_fsdp.py": _GPUS,
    "tests/test_torch_predictor.py": _PREDICTOR,
    "tests/test_torch_trainer.py": _NOT_IN("ray.train.torch.TorchPredictor, which it imports at its top; Ray Train "
                                           "V2's test_torch_trainer.py runs"),
    "tests/test_torch_transformers_train.py":
        "it needs the datasets package and a model from the Hugging Face Hub (no network here), and GPUs for half "
        "its cases; Transformers on elastic_train is tests/test_transformers.py",
    "tests/test_torch_utils.py": _INTERNALS + " (ray.air._internal.torch_utils)",
    "tests/test_train_head.py": _V1("ray.train._internal.state"),
    "tests/test_train_usage.py": _INTERNALS + " (ray._common.usage)",
    "tests/test_trainer_restore.py": _OTHER + "; and Ray's internals (ray.air._internal.uri_utils)",
    "tests/test_training_iterator.py": _V1("ray.train._internal.backend_executor, session"),
    "tests/test_tune.py": _OTHER + " (TensorFlow's example); and Ray's internals (ray.train._internal.worker_group)",
    "tests/test_worker_group.py": _V1("ray.train._internal.worker_group"),
    "tests/test_xgboost_predictor.py": _PREDICTOR,
    "tests/test_xgboost_trainer.py": _OTHER,
}

LEFT_OUT: dict[str, str] = {
    "v2/tests/test_torch_trainer.py::test_is_backend_nccl":
        f"{_INTERNALS}: it tests Ray's private helper ray.train.torch.config._is_backend_nccl",
    "v2/tests/test_v2_api.py::test_train_v2_import":
        f"{_INTERNALS}: the RAY_TRAIN_V2_ENABLED switch between Ray's V1 and V2 classes",
    "v2/tests/test_v2_api.py::test_trainer_restore":
        "on purpose: TorchTrainer.restore goes on with a stored run (seed 002 restores one), where Ray V2 "
        "deprecated it",
    "v2/tests/test_v2_api.py::test_serialized_imports":
        "on purpose: it imports TensorflowTrainer, XGBoostTrainer and LightGBMTrainer; elastic_train trains "
        "PyTorch (those names fail with what to use instead)",
    "v2/tests/test_result.py::test_result_restore[False-True-":
        f"{_INTERNALS}: the run's folder and filesystem come from Ray's StorageContext",
    "v2/tests/test_result.py::test_result_restore[True-True-":
        f"{_INTERNALS}: the run's folder and filesystem come from Ray's StorageContext",
    "v2/tests/test_result.py::test_result_from_path_validation":
        f"{_INTERNALS}: it matches the name of Ray's internal run snapshot file in the message",
    "v2/tests/test_data_parallel_trainer.py::test_setup_working_directory":
        f"{_INTERNALS} (its session folder); on purpose, the run's working directory is `<run name>_<hash of "
        "its storage folder>`, not `<run name>`: two runs of one name on a machine never share one",
    "v2/tests/test_data_parallel_trainer.py::test_result_output":
        f"on purpose: {_FSSPEC}; it asserts that Result.filesystem is pyarrow's",
    "v2/tests/test_persistence.py::test_trainer[checkpoint_config0-cloud]": _URL,
    "v2/tests/test_persistence.py::test_trainer[checkpoint_config1-cloud]": _URL,
    "v2/tests/test_async_checkpointing.py::test_report_checkpoint_upload_error":
        f"{_INTERNALS}: it mocks the worker's storage context (persist_current_checkpoint)",
    "v2/tests/test_collective.py::test_broadcast_from_rank_zero_data_too_big":
        f"{_INTERNALS}: it monkeypatches ray.train.collective's private _MAX_BROADCAST_SIZE_BYTES",
    "v2/tests/test_config.py::test_scaling_config_accelerator_type":
        f"{_INTERNALS} (ScalingConfig._resources_per_worker_not_none); on purpose, accelerator_type is refused, saying "
        "to ask for it as a resource",
    "v2/tests/test_config.py::test_scaling_config_validation":
        "on purpose: one of its checks builds ScalingConfig(use_gpu=True, use_tpu=True) and matches Ray's message "
        "for both; use_tpu alone is refused here (elastic_train trains on GPUs or CPUs), with its own message. Its "
        "other checks (GPU resources, label_selector lists) are tests/test_validation.py's",
    "v2/tests/test_config.py::test_scaling_config_tpu_":
        "on purpose: TPUs are refused (use_tpu), elastic_train trains on GPUs or CPUs",
    "v2/tests/test_data_integration.py::test_datasets_callback": f"{_INTERNALS}: Ray's DatasetsCallback and worker group",
    "v2/tests/test_data_integration.py::test_v2_no_negative_exclude_resources": f"{_INTERNALS}: Ray's DatasetsCallback",
    "v2/tests/test_data_integration.py::test_fixed_scaling_policy_coordinator_lifecycle": f"{_INTERNALS}: Ray's scaling policy",
    "v2/tests/test_data_integration.py::test_per_dataset_execution_options_dict":
        "on purpose: a split dataset's execution preserves order, whatever its options say (a restarted coordinator "
        "replays the epoch alike: every row once); a dataset not split keeps its options (README, Coming from "
        "Ray Train)",
    "v2/tests/test_serialization.py::test_captured_imports": f"{_INTERNALS}: Ray's ControllerCallback and TrainRunContext",
    "v2/tests/test_serialization.py::test_deserialization_error": f"{_INTERNALS}: Ray's ControllerCallback and TrainRunContext",
    "v2/tests/test_scheduling.py::test_infeasible_placement_strategy":
        f"{_INTERNALS}: Ray's worker group start timeout (ray.train.v2._internal.constants)",
    **dict.fromkeys((
        "tests/test_torch_lightning_train.py::test_trainer_with_native_dataloader[dataloader-gpu-",
        "tests/test_torch_lightning_train.py::test_trainer_with_native_dataloader[datamodule-gpu-",
        "tests/test_torch_lightning_train.py::test_trainer_with_ray_data[gpu-",
        "tests/test_torch_lightning_train.py::test_deepspeed_zero_stages",
        "tests/test_torch_accelerate.py::test_accelerate_base[True]",
        "tests/test_torch_accelerate.py::test_accelerate_deepspeed",
    ), _GPUS + " (its cluster's GPUs are Ray's resources only: CUDA is not there)"),
    "v2/tests/test_data_parallel_trainer.py::test_backend_setup":
        "on purpose: a Backend with hooks of its own is refused (backend.py): every generation's workers form "
        "their torch.distributed group themselves, with no hook in between",
}
